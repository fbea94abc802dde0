#!/usr/bin/env bash
# Assembles what bench/gpu_session.sh carries to a lent GPU, from this machine's model cache (run `make demo` or any
# command that loads the presets first): .gpu/ (each model's config and tokenizer files; no weights), .whl/ (the gguf
# wheel the GPU image lacks) and smollm2-135m's GGUF in two halves (.gpuw1/, .gpuw2/: a call carries 64 MiB, the
# tracked tree about 8 of it). All four folders are ignored through .git/info/exclude.
set -eu
cache="${SPECPLAN_CACHE:-$HOME/.cache/specplan}"
for ignored in /.gpu/ /.whl/ /.gpuw1/ /.gpuw2/; do
  grep -qxF "$ignored" .git/info/exclude || echo "$ignored" >> .git/info/exclude
done
rm -rf .gpu .whl .gpuw1 .gpuw2
mkdir -p .gpu .whl .gpuw1 .gpuw2
for preset in smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
  mkdir -p ".gpu/$preset"
  for name in config.json generation_config.json tokenizer_config.json chat_template.jinja; do
    [ -f "$cache/converted/$preset/$name" ] && cp "$cache/converted/$preset/$name" ".gpu/$preset/"
  done
done
cp "$cache/converted/smollm2-135m/tokenizer.json" .gpu/smollm2-135m/
cp "$cache/converted/qwen2.5-coder-1.5b/tokenizer.json" .gpu/qwen2.5-coder-1.5b/  # the 0.5b shares it (copied there)
for config in bench/configs/*.json; do  # other families' published configs, timed with random weights
  name=$(basename "$config" .json)
  mkdir -p ".gpu/$name" && cp "$config" ".gpu/$name/config.json"
done
.venv/bin/pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
gguf="$cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
head -c 41000000 "$gguf" > .gpuw1/part1
tail -c +41000001 "$gguf" > .gpuw2/part2
du -sh .gpu .whl .gpuw1 .gpuw2
