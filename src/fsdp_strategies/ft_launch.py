"""The launcher lives in :mod:`fsdp_strategies.ft.launcher`; this module keeps ``python -m fsdp_strategies.ft_launch``
and the old import path working."""

from fsdp_strategies.ft.launcher import (
    FTLauncher,
    LauncherResult,
    LaunchOptions,
    _last_error_line,
    _parse_kill_at,
    _process_tree,
    kill_tree,
    main,
    run,
)

__all__ = ["FTLauncher", "LaunchOptions", "LauncherResult", "_last_error_line", "_parse_kill_at", "_process_tree",
           "kill_tree", "main", "run"]

if __name__ == "__main__":
    main()
