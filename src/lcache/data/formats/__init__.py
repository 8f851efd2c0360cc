"""Existing shard formats as sources, without conversion: each reads its format's own index
and gives a ``RangeSource`` of sample-granular byte ranges, so the cache holds single
samples and a fetch coalesces the neighbours of one shard into one request.

- ``WebDatasetSource``: WebDataset tar shards (the index from the tar headers).
- ``MDSSource``: MosaicML streaming MDS shards (``index.json`` and the shard headers).
- ``LitDataSource``: LitData chunks (``index.json`` and the chunk headers).
- ``TableSource``: a table of (path, offset, length) in CSV or JSON.
"""

from lcache.data.formats.litdata import LitDataSource
from lcache.data.formats.mds import MDSSource
from lcache.data.formats.table import TableSource
from lcache.data.formats.webdataset import WebDatasetSource

__all__ = ["LitDataSource", "MDSSource", "TableSource", "WebDatasetSource"]
