"""Tests of the bench/ scripts (smoke runs)."""
