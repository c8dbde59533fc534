"""Data shipped with servetune, so it works without any download.

``SAMPLE_TRACE``: the first 300 s of the Mooncake conversation trace (918 requests, with
their prefix-block ids) as a native Parquet trace; see ``README.md`` here for its source
and licence.
"""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
SAMPLE_TRACE = DATA_DIR / "mooncake_conversation_300s.parquet"
