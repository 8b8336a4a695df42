"""One module per task (clm, sft, dpo, classify), each stating its parts to the one pipeline
(`pipeline`) whose steps live in `base`; `registry` finds them by name."""
