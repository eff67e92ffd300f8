"""The source scan's cache (`tests.env_reads.reads_under(..., cache_dir)`), which spares each run
a re-parse of SGLang's 2,000 files.

Regression guarded: a cached answer outliving the source it was read from (a changed file, an
added file) would let a sample keep a variable the engine stopped reading.
"""

from __future__ import annotations

from pathlib import Path

from tests.env_reads import reads_under


def test_a_cached_scan_answers_as_the_scan_and_any_change_scans_again(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    one = src / "one.py"
    one.write_text('import os\nos.getenv("FIRST")\n')
    cache = tmp_path / "cache"

    first = reads_under([one], cache)
    assert first.names == {"FIRST"} and len(list(cache.iterdir())) == 1
    again = reads_under([one], cache)
    assert again.names == first.names and again.prefixes == first.prefixes

    one.write_text('import os\nos.environ.get("SECOND")\n')
    assert reads_under([one], cache).names == {"SECOND"}
    two = src / "two.py"
    two.write_text('import os\nos.getenv("PREFIX_" + name)\n')
    both = reads_under([one, two], cache)
    assert both.names == {"SECOND"} and both.prefixes == {"PREFIX_"}
    assert both.names == reads_under([one, two]).names  # the uncached scan agrees
