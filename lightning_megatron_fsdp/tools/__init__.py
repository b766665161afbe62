"""Offline tools: inspect, verify and export checkpoints without a process group."""
