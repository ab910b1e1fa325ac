"""The Tinker training API over flywheel (`flywheel tinker serve`, docs/tinker.md): scripts written for
the tinker SDK and tinker-cookbook train LoRA adapters on a Registry base here, unmodified."""
