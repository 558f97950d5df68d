"""kvdb's command line (click). Thin: parse, call the public API, render."""
