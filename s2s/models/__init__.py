"""The model families: their configs, weights and forward passes over paged K/V, and the shipped weights."""
