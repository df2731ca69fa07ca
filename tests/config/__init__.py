"""Tests of megazero/config/."""
