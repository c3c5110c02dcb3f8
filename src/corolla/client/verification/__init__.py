"""Checking that servers compute what they claim: sampled steps re-run on other servers (`step_verifier`),
stretches recomputed by a replica (`stretches`), who may get a server banned on others' word and the servers outside
a dispute that recheck it, alone or as a chain holding its blocks together (`witnesses`, `chains`), whose fault are
outputs the next span's float16 server cannot hold (`range_dispute`), and a finding shared by someone else re-checked
first-hand without letting a liar frame anyone (`finding_check`; the finding record and the store of what this client
caught are routing's, `client.routing.findings` / `finding_store`, as they decide whom a client bans)."""
