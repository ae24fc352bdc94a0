# Sourced by gpu_run.sh and ab_rounds.sh. Autotuning choices are kept on disk across processes
# (configs.keep_choices_on_disk): a measuring process would otherwise find choices made by an earlier one,
# e.g. by 16 test workers tuning side by side (contended timings; in a grid of 2026-11-30 three
# s=2048 points ran 0.78-0.97x their freshly tuned speed that way), or by an earlier A/B round of the same
# side. forget_choices deletes them, so the next process tunes anew, as RESULTS.md says it does.
forget_choices() { find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name '*.autotune.json' -delete 2>/dev/null || true; }
