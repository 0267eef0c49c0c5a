"""Deployment configs, latency profiles and improvement-rate tables shipped with Tetris (data only)."""
