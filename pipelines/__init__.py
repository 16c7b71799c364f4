"""Command-line entry points (click). Thin: build a config, call one library function."""
