"""Tests of megazero/data/."""
