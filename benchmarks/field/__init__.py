"""Field-condition benchmarks: sessions through a WAN-proxied chain while links stall, drop and partition (`wan`)."""
