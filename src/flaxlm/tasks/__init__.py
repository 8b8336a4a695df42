"""One module per task (clm, classify) over a shared base; `registry` finds them by name."""
