"""Tests of megazero/plan/."""
