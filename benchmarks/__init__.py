"""The benchmarks, one folder per topic (README.md); run each script by its path from the checkout."""
