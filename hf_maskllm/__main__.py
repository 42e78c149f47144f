"""``python -m hf_maskllm`` runs the command line (see ``cli.py``)."""

from .cli import main

main()
