"""Capture router state from inference engines into v1 traces (llama.cpp via its eval callback)."""
