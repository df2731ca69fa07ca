"""Tests of megazero/checkpoint/."""
