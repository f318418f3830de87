"""``python -m fsdp_strategies.ft`` = the ``fsdp-strategies-ft`` console script."""

from fsdp_strategies.ft.launch.launcher import main

main()
