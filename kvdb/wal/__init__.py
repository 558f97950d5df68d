"""The write-ahead log: segments, writer with group commit, reader, recovery."""
