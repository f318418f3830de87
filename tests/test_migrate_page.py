"""docs/migrate.md builds every strategy and callback it maps Lightning's and DeepSpeed's options to."""

from __future__ import annotations

import re
from typing import Any

from conftest import ROOT


def test_the_migration_page_builds_what_it_names() -> None:
    page = (ROOT / "docs" / "migrate.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert blocks, "docs/migrate.md has no python block"
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "docs/migrate.md", "exec"), namespace)  # the page's own code
    built: dict[str, Any] = namespace
    assert type(built["trainer"].strategy).__name__ == "FSDP2Strategy"
    assert built["shard_grad_op"].reshard_after_forward is False
    assert (built["hybrid"].replicate_degree, built["hybrid"].shard_degree) == (2, 8)
    assert built["tensor_parallel"].tensor_parallel_degree == 2
