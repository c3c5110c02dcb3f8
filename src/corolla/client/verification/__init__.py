"""Checking that servers compute what they claim: sampled steps re-run on other servers (`step_verifier`),
stretches recomputed by a replica (`stretches`), and what was caught kept (`finding_store`) and shared as bytes
(`findings`) without letting a liar frame anyone (`finding_check`)."""
