"""Checking that servers compute what they claim: sampled steps re-run on other servers (`step_verifier`),
stretches recomputed by a replica (`stretches`) and findings shared without letting a liar frame anyone
(`findings`)."""
