# The everyday prompts of the batch benchmarks (sourced by bench-batch.sh, bench-distributed.sh
# and ab.sh): 16 subjects, and 4 ways of asking for a long answer so that greedy generation runs
# to max_tokens.
# long_prompts FILE MAX_TOKENS [ASKS]: ASKS (1..4, default 1) x 16 JSONL requests, greedy
# (temperature 0), ids 0.., the same file every time.
subjects=("how bread is baked" "the water cycle" "how to plant a vegetable garden" "the history of bicycles"
  "why people keep cats as pets" "how a train station works" "planning a birthday party" "the life of honey bees"
  "how to learn to swim" "the seasons of the year" "cooking a simple pasta dinner" "how libraries work"
  "a day at the beach" "how rain forms" "taking care of a dog" "the planets of the solar system")
asks=("Write a long, detailed explanation of %s." "Tell me a long story about %s."
  "Describe %s step by step, in as much detail as you can." "Write an essay of several paragraphs about %s.")

long_prompts() {
  local file=$1 max_tokens=$2 n_asks=${3:-1} n=0 a s p
  : > "$file"
  for a in "${asks[@]:0:$n_asks}"; do
    for s in "${subjects[@]}"; do
      # shellcheck disable=SC2059
      p=$(printf "$a" "$s")
      printf '{"id": %d, "prompt": "%s", "max_tokens": %d, "temperature": 0}\n' "$n" "$p" "$max_tokens" >> "$file"
      n=$((n + 1))
    done
  done
}
