"""Tests of megazero/train/."""
