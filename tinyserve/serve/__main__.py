"""``python -m tinyserve.serve``: see ``tinyserve.serve.cli``."""

from tinyserve.serve.cli import main

main()
