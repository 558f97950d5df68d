"""The write-ahead log: segments, the writer (append, rotate), group commit, reader, recovery, and
the segment source log shipping reads."""
