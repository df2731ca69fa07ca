"""Tests of parallel/ (ZeRO included)."""
