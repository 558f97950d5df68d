"""Trace readers, generators and replays; they drive the same policy objects as the engine."""
