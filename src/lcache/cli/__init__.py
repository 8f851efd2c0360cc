"""The ``lcache`` command line: parses, calls library functions, prints."""
