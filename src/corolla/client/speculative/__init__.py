"""Speculative decoding: the config, the acceptance rule and the choice of k (`acceptance`), the drafters
(`drafters`) and the loop that verifies k drafted tokens in one inference step (`loop`)."""
