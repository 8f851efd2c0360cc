"""The strace log parser on lines in strace's own format (threads, errors, positions)."""

from __future__ import annotations

from lcache.trace.strace import parse

LOG = """\
100 1700000000.000100 openat(AT_FDCWD</w>, "/data/a.bin", O_RDONLY) = 3</data/a.bin> <0.000010>
100 1700000000.000200 read(3</data/a.bin>, ""..., 4096) = 4096 <0.000020>
101 1700000000.000250 pread64(3</data/a.bin>, <unfinished ...>
100 1700000000.000300 read(3</data/a.bin>, ""..., 4096) = 100 <0.000005>
101 1700000000.000400 <... pread64 resumed>""..., 512, 8192) = 512 <0.000150>
100 1700000000.000500 lseek(3</data/a.bin>, 0, SEEK_SET) = 0 <0.000002>
100 1700000000.000600 read(3</data/a.bin>, ""..., 10) = 10 <0.000003>
100 1700000000.000700 write(1</dev/pts/0>, ""..., 5) = 5 <0.000003>
100 1700000000.000800 read(4<pipe:[1234]>, ""..., 5) = 5 <0.000003>
100 1700000000.000900 pwrite64(5</data/b.bin>, ""..., 64, 128) = -1 ENOSPC (No space) <0.000004>
100 1700000000.001000 fdatasync(5</data/b.bin>) = 0 <0.001000>
100 1700000000.001100 read(6</data/c.bin>, ""..., 8) = 8 <0.000001>
100 1700000000.001200 +++ exited with 0 +++
"""


def test_parse_strace_lines() -> None:
    events = list(parse(LOG.splitlines(keepends=True), wall_minus_mono_us=1_700_000_000e6))
    got = [(e["pid"], e["name"], e["args"]["file"], e["args"]["off"], e["args"]["size"],
            e["args"]["ret"], e["args"]["sys"]) for e in events]
    assert got == [
        (100, "read", "/data/a.bin", 0, 4096, 4096, "read"),
        (100, "read", "/data/a.bin", 4096, 4096, 100, "read"),
        (101, "read", "/data/a.bin", 8192, 512, 512, "pread64"),  # stitched, start time kept
        (100, "read", "/data/a.bin", 0, 10, 10, "read"),  # after lseek to 0
        (100, "write", "/data/b.bin", 128, 64, -28, "pwrite64"),  # -ENOSPC
        (100, "fdatasync", "/data/b.bin", 0, 0, 0, "fdatasync"),
        (100, "read", "/data/c.bin", -1, 8, 8, "read"),  # opened before tracing: unknown
    ]
    assert events[0]["ts"] == 200.0 and events[0]["dur"] == 20.0  # monotonic microseconds
    assert events[2]["ts"] == 250.0 and events[2]["dur"] == 150.0


COPIES = """\
7 1700000000.000100 openat(AT_FDCWD</w>, "/d/out", O_WRONLY|O_CREAT, 0644) = 4</d/out> <0.000010>
7 1700000000.000200 sendfile(4</d/out>, 3</d/in>, [0] => [65536], 65536) = 65536 <0.000020>
7 1700000000.000300 sendfile(4</d/out>, 3</d/in>, NULL, 100) = 100 <0.000020>
7 1700000000.000400 copy_file_range(3</d/in>, [4096] => [4196], 5</d/c>, NULL, 100, 0) = 100 \
<0.000030>
7 1700000000.000450 copy_file_range(3</d/in>, NULL, 5</d/c>, NULL, 9223372035781033984, 0) = 3 \
<0.000030>
7 1700000000.000500 splice(3</d/in>, [8], 6<pipe:[99]>, NULL, 16, 0) = 16 <0.000001>
7 1700000000.000600 mmap(NULL, 8192, PROT_READ, MAP_SHARED, 3</d/in>, 0x1000) = 0x7f00 <0.000001>
7 1700000000.000700 mmap(NULL, 4096, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0) \
= 0x7f0 <0.000001>
"""


def test_copies_between_fds_and_file_mappings() -> None:
    events = list(parse(COPIES.splitlines(keepends=True), wall_minus_mono_us=0.0))
    got = [(e["name"], e["args"]["file"], e["args"]["off"], e["args"]["size"],
            e["args"]["ret"], e["args"]["sys"]) for e in events]
    assert got == [
        ("read", "/d/in", 0, 65536, 65536, "sendfile"),  # offset given
        ("write", "/d/out", 0, 65536, 65536, "sendfile"),  # out: just opened, at 0
        ("read", "/d/in", -1, 100, 100, "sendfile"),  # in's position: opened before
        ("write", "/d/out", 65536, 100, 100, "sendfile"),
        ("read", "/d/in", 4096, 100, 100, "copy_file_range"),
        ("write", "/d/c", -1, 100, 100, "copy_file_range"),
        # GNU cp 9 asks for SSIZE_MAX - 1 GiB ("all of it"): the size is what moved
        ("read", "/d/in", -1, 3, 3, "copy_file_range"),
        ("write", "/d/c", -1, 3, 3, "copy_file_range"),
        ("read", "/d/in", 8, 16, 16, "splice"),  # the pipe side is not storage
        ("mmap", "/d/in", 4096, 8192, 0, "mmap"),  # mapped; the faults' bytes unseen
    ]


# Lines strace 6.1 wrote (-D -f -qq -ttt -T -y -s 0) for files with odd names, unlinked files,
# a memfd, a pipe and a socket (paths shortened to /d).
ODD_NAMES = r"""
9 1796647229.000001 read(3</d/donn\303\251es.bin>, ""..., 3) = 3 <0.000001>
9 1796647229.000002 read(3</d/bad\377\376.bin>, ""..., 3) = 3 <0.000001>
9 1796647229.000003 read(3</d/a\74b\76.bin>, ""..., 3) = 3 <0.000001>
9 1796647229.000004 read(3</d/nl\nx\tq\"u\\v\33[m.bin>, ""..., 3) = 3 <0.000001>
9 1796647229.000005 read(3</d/x:[1].bin>, ""..., 3) = 3 <0.000001>
9 1796647229.000006 read(3</d/z\76(deleted), 5.bin>, ""..., 3) = 3 <0.000001>
9 1796647229.000007 openat(AT_FDCWD</d>, "a) = 7 b[.bin", O_RDWR|O_CREAT|O_CLOEXEC, 0777) \
= 7</d/a) = 7 b[.bin> <0.000032>
9 1796647229.000008 write(7</d/a) = 7 b[.bin>, ""..., 10) = 10 <0.000010>
9 1796647229.000009 pwrite64(7</d/a) = 7 b[.bin>, ""..., 5, 3) = 5 <0.000007>
9 1796647229.000010 openat(AT_FDCWD</d>, "O_APPEND.bin", O_RDWR|O_CREAT|O_CLOEXEC, 0777) \
= 10</d/O_APPEND.bin> <0.000029>
9 1796647229.000011 write(10</d/O_APPEND.bin>, ""..., 10) = 10 <0.000011>
9 1796647229.000012 sendfile(8</d/c{p,y}[.bin>, 7</d/x:[1].bin>, [0] => [5], 5) = 5 <0.000018>
9 1796647229.000013 mmap(NULL, 10, PROT_READ, MAP_SHARED, 7</d/x:[1].bin>, 0) = 0x7f00 <0.00001>
9 1796647229.000014 write(3</d/gone.bin>(deleted), ""..., 5000) = 5000 <0.000001>
9 1796647229.000015 write(3</d/odd\377\76(deleted)>(deleted), ""..., 50) = 50 <0.000001>
9 1796647229.000016 write(3</d/#2318647>(deleted), ""..., 7000) = 7000 <0.000001>
9 1796647229.000017 write(3</memfd:buf>(deleted), ""..., 10) = 10 <0.000019>
9 1796647229.000018 write(4<pipe:[2678431]>, ""..., 2) = 2 <0.000008>
9 1796647229.000019 read(5<socket:[2678432]>, ""..., 1) = 1 <0.000008>
9 1796647229.000020 read(6<anon_inode:[eventfd]>, ""..., 8) = 8 <0.000008>
"""


def test_names_are_the_real_paths_and_unlinked_files_are_kept() -> None:
    """The finding (attack helper 87): names were strace's escaped spelling
    (``donn\\303\\251es.bin``), a file named ``x:[1].bin`` was taken for a socket, and writes
    to an unlinked file (``3</p>(deleted)``, every TemporaryFile) were dropped."""
    events = list(parse(ODD_NAMES.replace("\\\n", "").splitlines(), wall_minus_mono_us=0.0))
    got = [(e["name"], e["args"]["file"], e["args"]["off"], e["args"]["ret"]) for e in events]
    assert got == [
        ("read", "/d/données.bin", -1, 3),
        ("read", "/d/bad\udcff\udcfe.bin", -1, 3),  # os.fsdecode of the bytes
        ("read", "/d/a<b>.bin", -1, 3),
        ("read", '/d/nl\nx\tq"u\\v\x1b[m.bin', -1, 3),
        ("read", "/d/x:[1].bin", -1, 3),
        ("read", "/d/z>(deleted), 5.bin", -1, 3),  # "(deleted)" inside the name: not unlinked
        ("write", "/d/a) = 7 b[.bin", 0, 10),  # ") = 7" in a name is not the result
        ("write", "/d/a) = 7 b[.bin", 3, 5),
        ("write", "/d/O_APPEND.bin", 0, 10),  # the name is no flag
        ("read", "/d/x:[1].bin", 0, 5),  # sendfile: "," and "{" in a name split nothing
        ("write", "/d/c{p,y}[.bin", -1, 5),
        ("mmap", "/d/x:[1].bin", 0, 0),
        ("write", "/d/gone.bin (deleted)", -1, 5000),  # as /proc/<pid>/fd names it
        ("write", "/d/odd\udcff>(deleted) (deleted)", -1, 50),
        ("write", "/d/#2318647 (deleted)", -1, 7000),  # an O_TMPFILE file
    ]  # the memfd, pipe, socket and eventfd are not storage
