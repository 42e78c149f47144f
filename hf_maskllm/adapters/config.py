"""``MaskConfig``: everything that defines a MaskLLM run, saved as ``mask_config.json``."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MaskFileError
from ..hub import is_hub_repo_id
from ..patterns import check_nm_args, num_candidates
from ..priors.calibration import PRIOR_METHODS
from ..serialization import load_json, resolve_folder, save_json
from ..version import __version__

__all__ = ["CONFIG_NAME", "FORMAT_VERSION", "PAPER_MASK_CONFIG", "MaskConfig"]

CONFIG_NAME = "mask_config.json"
FORMAT_VERSION = 1
SCHEDULES = ("linear", "cosine", "exponential")
# The paper's objective, the language-model loss alone. A saved config leaves out the fields that hold
# these values, and a saved config without them reads them (older files: what those masks learned with).
PAPER_OBJECTIVE = {"lm_weight": 1.0, "distill_logits": 0.0, "distill_temperature": 1.0, "distill_hidden": 0.0}
# Fields added after files of format version 1 were first written (the objective's and the Wanda order's),
# at the values that files without them were learned with.
ADDED_DEFAULTS = {**PAPER_OBJECTIVE, "wanda_strength": 0.0}
ADDED_FIELDS = tuple(ADDED_DEFAULTS)
LOGITS_DTYPES = ("float32", "bfloat16", "float16")
# The paper's temperature, logit scale, prior start and objective, where the defaults differ or may
# differ: ``MaskConfig(prior=..., **PAPER_MASK_CONFIG)`` starts, anneals and learns as the paper does.
PAPER_MASK_CONFIG = {
    "tau": (4.0, 0.05),
    "kappa": (100.0, 500.0),
    "prior_strength": 3.0,
    "init_std": 0.01,
    "wanda_strength": 0.0,
    "distill_logits": 0.0,
}


@dataclass
class MaskConfig:
    """Configuration of learnable N:M masks (MaskLLM).

    Args:
        n: Weights kept in every group of ``m`` consecutive inputs (default 2).
        m: Group size, at most 8 (default 4). Candidates are all ``C(m, n)`` patterns in
            ``itertools.combinations`` order.
        target_modules: Which layers get a mask: ``"all-linear"`` (every Linear / GPT-2 Conv1D
            except the output embedding), a list of name suffixes, or a regex (full match).
        exclude_modules: Layers never masked: list of name suffixes or a regex (full match).
        tau: Gumbel-softmax temperature ``(start, end)``, annealed over training (2.0 -> 0.05; the
            paper starts at 4.0: ``tau=(4.0, 0.05)``, see docs/training.md for why the default differs).
        kappa: Logit scale ``(start, end)``; the sampled distribution is ``softmax(kappa * logits)``
            (100 -> 1000; the paper ends at 500: ``kappa=(100.0, 500.0)``, see docs/training.md).
        tau_schedule: ``"linear"`` (the paper), ``"cosine"`` or ``"exponential"``.
        kappa_schedule: Same choices, for kappa.
        hard: Straight-through hard samples instead of soft ones (the paper found soft better).
        prior: One-shot prior: ``"magnitude"``, ``"wanda"``, ``"sparsegpt"``, a folder or Hub repo id
            of a saved mask (transfer learning), or ``None`` for random logits. A list of these adds
            their prior terms: ``[general_mask_folder, "sparsegpt"]`` starts a domain mask where the
            general mask and the domain's one-shot mask agree, and leaves the groups where they
            disagree to learning (see docs/downstream.md).
        prior_strength: ``alpha`` of the prior rule ``logits += alpha * std * (overlap - n/2)``
            (per prior, for a list). 4.0; the paper's is 3.0 (``prior_strength=3.0``), see
            docs/training.md for why the default differs.
        wanda_strength: ``beta`` of the Wanda order, applied after the prior rule:
            ``logits -= beta * std * (log e_c - mean_c log e_c)`` (clipped to 3 standard deviations), where
            ``e_c`` is the Wanda error of candidate ``c``, ``sum (W_j * ||X_j||)^2`` over the weights it
            prunes, ``X`` the layer's inputs on the calibration data. The prior's pattern still leads
            every group; the others start in the order Wanda ranks them, and where Wanda prefers
            another pattern the prior's lead shrinks. Default ``None``: 4.0 when the mask starts from a
            prior and calibration data is given, else 0.0 (filled in when the mask is added; the saved
            config holds the value used). The paper's: 0.0 (see docs/training.md).
        calibration_samples: Sequences used by data-driven priors.
        calibration_seqlen: Tokens per calibration sequence.
        sparse_reg: ``lambda`` of the sparse weight regulariser, decaying linearly to 0.
        init_std: Std of the normal initialisation of the logits.
        logits_dtype: ``"bfloat16"`` (default: 3 bytes per masked weight; train it with
            :class:`~hf_maskllm.MaskAdamW`, whose stochastic rounding keeps small updates),
            ``"float32"`` (the reference) or ``"float16"``.
        lm_weight: Weight of the language-model loss in the training objective (1.0, the paper's).
        distill_logits: Weight of distillation from the unmasked model's next-token distribution: the KL
            divergence at ``distill_temperature`` (times its square), per predicted token. Default
            ``None``: 1.0 for a causal language model, 0 for other models, filled in when the mask is
            added to a model; 0 is the paper's objective (the language-model loss alone).
        distill_temperature: Temperature of that distribution (teacher and student alike).
        distill_hidden: Weight of distillation from the unmasked model's hidden states after every decoder
            block: the squared error relative to the teacher's squared norm, per token, averaged over
            blocks. The unmasked model is the same weights run without masks (no second copy).
        seed: Seed of the logit initialisation.
        strict: Raise (instead of warn and skip) when a target's input size is not divisible by ``m``.
        base_model_name_or_path: Filled in by ``get_mask_model``; recorded in saved masks.
    """

    n: int = field(default=2, metadata={"help": "Weights kept per group of m."})
    m: int = field(default=4, metadata={"help": "Group size (consecutive inputs), at most 8."})
    target_modules: str | list[str] = field(
        default="all-linear",
        metadata={"help": "'all-linear', a list of name suffixes, or a full-match regex."},
    )
    exclude_modules: str | list[str] | None = field(
        default=None, metadata={"help": "Suffixes or full-match regex of layers never masked."}
    )
    tau: tuple[float, float] = field(
        default=(2.0, 0.05), metadata={"help": "Gumbel temperature start, end (the paper: 4.0, 0.05)."}
    )
    kappa: tuple[float, float] = field(
        default=(100.0, 1000.0), metadata={"help": "Logit scale start, end (the paper: 100, 500)."}
    )
    tau_schedule: str = field(default="linear", metadata={"help": "linear | cosine | exponential"})
    kappa_schedule: str = field(default="linear", metadata={"help": "linear | cosine | exponential"})
    hard: bool = field(default=False, metadata={"help": "Straight-through hard Gumbel samples."})
    prior: str | list[str] | None = field(
        default=None,
        metadata={
            "help": "magnitude | wanda | sparsegpt | saved mask folder / repo id | a list of these | None"
        },
    )
    prior_strength: float = field(default=4.0, metadata={"help": "alpha of the prior rule (the paper: 3.0)."})
    wanda_strength: float | None = field(
        default=None,
        metadata={
            "help": "beta of the Wanda order of the starting candidates (default: 4.0 with a prior and "
            "calibration data, else 0; the paper: 0)."
        },
    )
    calibration_samples: int = field(
        default=128, metadata={"help": "Sequences for wanda / sparsegpt priors."}
    )
    calibration_seqlen: int = field(default=512, metadata={"help": "Tokens per calibration sequence."})
    sparse_reg: float = field(
        default=1e-5, metadata={"help": "Sparse weight regulariser lambda (decays to 0)."}
    )
    init_std: float = field(default=0.01, metadata={"help": "Std of the logits' normal init."})
    logits_dtype: str = field(
        default="bfloat16", metadata={"help": "bfloat16 (train with MaskAdamW) | float32 | float16"}
    )
    lm_weight: float = field(default=1.0, metadata={"help": "Weight of the language-model loss."})
    distill_logits: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the KL to the unmasked model's next-token distribution (default: 1.0 for a "
            "causal LM, 0 otherwise; the paper: 0)."
        },
    )
    distill_temperature: float = field(default=1.0, metadata={"help": "Temperature of that KL."})
    distill_hidden: float = field(
        default=0.0, metadata={"help": "Weight of the normalised MSE to the unmasked model's hidden states."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the logit initialisation."})
    strict: bool = field(default=False, metadata={"help": "Error instead of skip for non-divisible layers."})
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "Recorded base model."})

    def __post_init__(self) -> None:
        if isinstance(self.tau, list):
            self.tau = tuple(self.tau)
        if isinstance(self.kappa, list):
            self.kappa = tuple(self.kappa)
        if isinstance(self.prior, tuple):
            self.prior = list(self.prior)
        if isinstance(self.prior, list) and len(self.prior) == 1:
            self.prior = self.prior[0]
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid field and how to fix it."""
        check_nm_args(self.n, self.m)
        _check_targets("target_modules", self.target_modules, allow_none=False)
        _check_targets("exclude_modules", self.exclude_modules, allow_none=True)
        for name in ("tau", "kappa"):
            value = getattr(self, name)
            if (
                not isinstance(value, tuple)
                or len(value) != 2
                or not all(_is_number(v) and v > 0 and v == v and v != float("inf") for v in value)
            ):
                raise ConfigError(
                    f"`{name}` must be a pair of finite positive numbers (start, end), got {value!r}."
                )
        for name in ("tau_schedule", "kappa_schedule"):
            if getattr(self, name) not in SCHEDULES:
                raise ConfigError(f"`{name}` must be one of {SCHEDULES}, got {getattr(self, name)!r}.")
        if not isinstance(self.hard, bool):
            raise ConfigError(f"`hard` must be True or False, got {self.hard!r}.")
        if not isinstance(self.strict, bool):
            raise ConfigError(f"`strict` must be True or False, got {self.strict!r}.")
        sources = self.prior if isinstance(self.prior, list) else [self.prior]
        if self.prior is not None and (
            not sources
            or not all(isinstance(s, str) and s for s in sources)
            or len(set(sources)) < len(sources)
        ):
            raise ConfigError(
                f"`prior` must be None, one of {PRIOR_METHODS}, a saved mask folder / Hub repo id, or a list of "
                f"distinct such names; got {self.prior!r}."
            )
        for name, low in (("prior_strength", 0.0), ("sparse_reg", 0.0)):
            value = getattr(self, name)
            if not _is_number(value) or not (value >= low) or value == float("inf"):
                raise ConfigError(f"`{name}` must be a finite number >= {low}, got {value!r}.")
        for name in ("wanda_strength", "lm_weight", "distill_logits", "distill_hidden"):
            value = getattr(self, name)
            # None: filled in when the mask is added (resolve_wanda_strength, resolve_objective)
            if name in ("wanda_strength", "distill_logits") and value is None:
                continue
            if not _is_number(value) or not (value >= 0) or value == float("inf"):
                raise ConfigError(f"`{name}` must be a finite number >= 0, got {value!r}.")
        distill_logits = 1.0 if self.distill_logits is None else self.distill_logits
        if not (self.lm_weight > 0 or distill_logits > 0 or self.distill_hidden > 0):
            raise ConfigError(
                "lm_weight, distill_logits and distill_hidden are all 0: the masks would learn nothing. Give at "
                "least one a positive weight (lm_weight=1.0 is the paper's objective)."
            )
        if not _is_number(self.distill_temperature) or not (0 < self.distill_temperature < float("inf")):
            raise ConfigError(
                f"`distill_temperature` must be a finite number > 0, got {self.distill_temperature!r}."
            )
        if not _is_number(self.init_std) or not (0 < self.init_std < float("inf")):
            raise ConfigError(f"`init_std` must be a finite number > 0, got {self.init_std!r}.")
        for name in ("calibration_samples", "calibration_seqlen"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.logits_dtype not in LOGITS_DTYPES:
            raise ConfigError(f"`logits_dtype` must be one of {LOGITS_DTYPES}, got {self.logits_dtype!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64:
            raise ConfigError(
                f"`seed` must be an integer in [-2**63, 2**64) (a torch seed), got {self.seed!r}."
            )
        if self.base_model_name_or_path is not None and not isinstance(self.base_model_name_or_path, str):
            raise ConfigError(
                f"`base_model_name_or_path` must be a string or None, got {self.base_model_name_or_path!r}."
            )

    @property
    def distills(self) -> bool:
        """Whether the objective distils the unmasked model (``distill_logits`` or ``distill_hidden`` > 0)."""
        return (self.distill_logits or 0.0) > 0 or self.distill_hidden > 0

    def resolve_objective(self, causal_lm: bool) -> None:
        """Fill in ``distill_logits=None`` (the default) for the model the mask trains on: 1.0 for a
        causal language model, 0.0 (the language-model loss alone) for others."""
        if self.distill_logits is None:
            self.distill_logits = 1.0 if causal_lm else 0.0

    def resolve_wanda_strength(self, has_calibration: bool) -> None:
        """Fill in ``wanda_strength=None`` (the default): 4.0 when the mask starts from a prior and
        calibration data is given, 0.0 otherwise; refuse a positive value that cannot apply."""
        if self.wanda_strength is None:
            self.wanda_strength = 4.0 if self.prior_sources and has_calibration else 0.0
        elif self.wanda_strength > 0 and not self.prior_sources:
            raise ConfigError(
                f"wanda_strength={self.wanda_strength} orders the candidates around a prior's pattern, and "
                "prior is None: set prior= (e.g. 'sparsegpt'), or wanda_strength=0."
            )
        elif self.wanda_strength > 0 and not has_calibration:
            raise ConfigError(
                f"wanda_strength={self.wanda_strength} needs calibration data for the layers' input norms: pass "
                "calibration_data= (token ids [S, L], or texts / a dataset with tokenizer=), or set "
                "wanda_strength=0."
            )

    @property
    def num_candidates(self) -> int:
        """``C(m, n)``: the number of candidate patterns per group."""
        return num_candidates(self.n, self.m)

    @property
    def prior_sources(self) -> list[str]:
        """``prior`` as a list: ``[]`` without a prior, one name, or the names of a combined prior."""
        if self.prior is None:
            return []
        return list(self.prior) if isinstance(self.prior, list) else [self.prior]

    def check_prior_source(self) -> None:
        """Refuse a ``prior`` that names neither a method, an existing folder nor a Hub repo id.

        A bare name such as ``"sparsegtp"`` would otherwise be looked up on the Hub and fail with a
        network error that never lists the methods.
        """
        for prior in self.prior_sources:
            if prior in PRIOR_METHODS or os.path.exists(prior) or is_hub_repo_id(prior):
                continue
            close = difflib.get_close_matches(prior.lower(), PRIOR_METHODS, n=1, cutoff=0.6)
            hint = f" Did you mean prior={close[0]!r}?" if close else ""
            raise ConfigError(
                f"`prior`={prior!r} is not a one-shot method {PRIOR_METHODS}, an existing mask folder, or a Hub "
                f"repo id ('owner/name').{hint}"
            )

    @property
    def prior_is_method(self) -> bool:
        """True when ``prior`` is a single one-shot method rather than a saved mask or a combination."""
        return isinstance(self.prior, str) and self.prior in PRIOR_METHODS

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of all fields."""
        d = dataclasses.asdict(self)
        d["tau"], d["kappa"] = list(self.tau), list(self.kappa)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], require_all: bool = False) -> MaskConfig:
        """Build a config from a dict; unknown fields (or, with ``require_all``, missing ones) are errors."""
        if not isinstance(data, dict):
            raise ConfigError(f"A MaskConfig must be built from a dict, got {type(data).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k not in ("format_version", "hf_maskllm_version")}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"Unknown MaskConfig field(s) {unknown}; valid fields are {sorted(names)}.")
        if require_all:  # a saved file: one written before the objective fields learned the paper's
            data = {**ADDED_DEFAULTS, **data}
            missing = sorted(names - set(data))
            if missing:
                raise ConfigError(
                    f"MaskConfig is missing field(s) {missing}; the file is incomplete, save it again."
                )
        try:
            return cls(**data)
        except TypeError as e:  # e.g. a list where a number is expected makes a comparison fail
            raise ConfigError(f"Invalid MaskConfig value: {e}") from e

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``mask_config.json`` (atomically) into ``save_directory``."""
        data = self.to_dict()
        for name in ADDED_FIELDS:  # at the paper's values, left out: older hf_maskllm versions read the file
            if data[name] == ADDED_DEFAULTS[name]:
                del data[name]
        data["format_version"] = FORMAT_VERSION
        data["hf_maskllm_version"] = __version__
        save_json(data, Path(save_directory) / CONFIG_NAME)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, revision: str | None = None) -> MaskConfig:
        """Read ``mask_config.json`` from a folder or a Hub repo id."""
        folder = resolve_folder(
            name_or_path, [CONFIG_NAME], error=MaskFileError, what="mask folder", revision=revision
        )
        data = load_json(folder / CONFIG_NAME, error=MaskFileError, what="mask config")
        if not isinstance(data, dict):
            raise MaskFileError(f"{folder / CONFIG_NAME} must hold a JSON object, got {type(data).__name__}.")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise MaskFileError(
                f"{folder / CONFIG_NAME} has no integer `format_version`; it is not an hf_maskllm mask."
            )
        if version > FORMAT_VERSION:
            raise MaskFileError(
                f"{folder / CONFIG_NAME} uses mask format version {version}, newer than this hf_maskllm "
                f"supports ({FORMAT_VERSION}); upgrade with `pip install -U hf_maskllm`."
            )
        try:
            return cls.from_dict(data, require_all=True)
        except ConfigError as e:
            raise MaskFileError(f"{folder / CONFIG_NAME}: {e}") from e


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_targets(name: str, value: object, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, str):
        if not value:
            raise ConfigError(f"`{name}` must not be an empty string.")
        if value != "all-linear":
            try:
                re.compile(value)
            except re.error as e:
                raise ConfigError(f"`{name}` {value!r} is not a valid regular expression: {e}.") from e
        return
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return
    raise ConfigError(
        f"`{name}` must be 'all-linear', a non-empty list of module-name suffixes, or a regex string; got {value!r}."
    )
