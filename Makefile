# hybridsparse: every stage is a console command and a make target.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
MODEL ?=
ARGS ?=
TOKENS ?= 50000
VRAM ?= 11
HF ?=
OUTTYPE ?= f16
OUT ?=
TYPE ?= Q4_0
S ?= S4
model_flag = $(if $(MODEL),-m $(MODEL),)

.PHONY: install demo run test test-gpu bench scenario profile train-predictor solve relu-model convert quantize perplexity serve batched clean

install:  ## install the package (editable) and build the compiled kernels
	$(PIP) install -e '.[test]'
	$(PYTHON) -m hybridsparse.runtime.kernels

demo: install  ## install, then generate from the embedded Gemma 3 270M
	hs-run -p "Once upon a time" -n 64 --temp 0 $(ARGS)

run:  ## make run MODEL=path.gguf ARGS="-p 'Hello' -n 64"
	hs-run $(model_flag) $(ARGS)

test: install  ## install, then run the test suite (GPU tests skip without CUDA)
	$(PYTHON) -m pytest -q tests

test-gpu:  ## the GPU tests alone (on a CUDA machine)
	$(PYTHON) -m pytest -q tests/gpu

bench:  ## decode/prefill speed of hs-run (JSON under bench-results/)
	hs-bench run $(model_flag) $(ARGS)

scenario:  ## make scenario S=S1: a benchmark scenario (S1-S5) on a synthetic real-scale model (GPU machine)
	hs-bench scenario $(S) --json bench-results/scenario-$(S).json $(ARGS)

profile:  ## make profile MODEL=path.gguf [TOKENS=50000]: activation counts + plot next to the model
	hs-profile $(model_flag) --tokens $(TOKENS) --plot $(ARGS)

train-predictor:  ## make train-predictor MODEL=path.gguf: profile with samples, then train the predictors
	hs-profile $(model_flag) --tokens $(TOKENS) --samples $(TOKENS) $(ARGS)
	hs-train-predictor $(model_flag)

convert:  ## make convert HF=hf_folder [OUTTYPE=f16] [ARGS="--powerinfer --predictors DIR"]: Hugging Face -> GGUF
	hs-convert $(HF) --outtype $(OUTTYPE) $(ARGS)

quantize:  ## make quantize MODEL=in.gguf OUT=out.gguf TYPE=Q4_0
	hs-quantize $(MODEL) $(OUT) $(TYPE) $(ARGS)

perplexity:  ## make perplexity MODEL=path.gguf [ARGS="-f text.txt -c 512"]
	hs-perplexity $(model_flag) $(ARGS)

serve:  ## make serve MODEL=path.gguf ARGS="--port 8080 -np 4": the OpenAI-compatible server
	hs-serve $(model_flag) $(ARGS)

batched:  ## make batched MODEL=path.gguf ARGS="-p 'Hello' -np 4 -n 32": sequences decoded together
	hs-batched $(model_flag) $(ARGS)

solve:  ## make solve MODEL=path.gguf [VRAM=11]: place neurons under the VRAM budget, write the GPU index
	hs-solve $(model_flag) --vram-budget $(VRAM) $(ARGS)

relu-model:  ## train the project's small ReLU Llama (~7 min on 2 cores; cached under ~/.cache/hybridsparse/models)
	$(PYTHON) -m hybridsparse.predictor_training.relu_model $(ARGS)

clean:
	rm -rf build *.egg-info .pytest_cache
