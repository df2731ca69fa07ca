"""The suite: one folder per package it tests; dist.py spawns gloo ranks, runs.py and hostile.py are shared helpers."""
