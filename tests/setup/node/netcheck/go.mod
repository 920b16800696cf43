module npufleet.local/netcheck

go 1.24
