"""Tests of megazero/interop/."""
