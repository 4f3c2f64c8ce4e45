"""Tests of pagoda.quant."""
