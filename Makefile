# The two commands a new user needs:
#   make demo   convert the bundled tinycode drafter, decode a prompt plainly and speculatively, compare
#   make test   run the test suite
# Both install into ./.venv first (scripts/install.sh); CMAKE_ARGS passes through
# to llama-cpp-python's build (e.g. CMAKE_ARGS="-DGGML_CUDA=on").
PY := .venv/bin/python
EX := examples/tinycode
OUT := out

.PHONY: install install-test demo test llama-server hybrid clean

install:
	scripts/install.sh

install-test:
	scripts/install.sh --test

demo: install
	@mkdir -p $(OUT)
	.venv/bin/dflash-convert $(EX)/drafter-dflash2 --target $(EX)/target-f16.gguf --outfile $(OUT)/tinycode-dflash2-{ftype}.gguf --outtype q4_0 --force
	$(PY) scripts/demo.py --target $(EX)/target-f16.gguf --draft $(OUT)/tinycode-dflash2-q4_0.gguf -n 128

llama-server:
	scripts/build_llama_server.sh

# the tinycode pair on a Qwen3.5 hybrid target (examples/tinycode-hybrid/README.md); needs the test install
hybrid: install-test llama-server
	$(PY) scripts/make_hybrid_pair.py

test: install-test llama-server
	$(PY) -m pytest -q

clean:
	rm -rf build $(OUT)
