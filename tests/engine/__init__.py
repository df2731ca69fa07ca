"""Tests of megazero/engine/."""
