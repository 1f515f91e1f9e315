# Thin wrapper over CMake: `make demo`, `make test`, `make sanitize`, `make bench`.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=
# make's "Entering directory" lines say nothing a reader needs.
MAKEFLAGS += --no-print-directory

.PHONY: all build build-all test sanitize demo bench synth python-test gpu-torch bench-torch bench-torch-lockstep bench-torch-paired bench-torch-requests gpu-bench format format-check clean

all: build

# The library and the command line alone; `make test` builds the tests too.
build:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS) --target gpumem gpumem_static gpumem_cli

# CTest shows only failed tests' output: the skips, and why, are printed after.
SKIP_REASONS = if command -v python3 >/dev/null; then python3 $(CURDIR)/tests/skip_reasons.py .; fi

test:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)
	@cd $(BUILD) && { ctest --output-on-failure -j $(JOBS); rc=$$?; $(SKIP_REASONS); exit $$rc; }

# The same suite under AddressSanitizer and UndefinedBehaviorSanitizer.
sanitize:
	@cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DGPUMEM_SANITIZE=ON >/dev/null
	@cmake --build build-asan -j $(JOBS)
	@cd build-asan && { ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS); rc=$$?; $(SKIP_REASONS); exit $$rc; }

# The main job: replay the bundled traces under PyTorch's rules and gpumem
# on the simulated device and print one plain table (the full one:
# gpumem replay --compare --detail). The build is quiet: one
# line when the command line must be (re)built, the build's log only if it fails.
demo:
	@if [ ! -x $(BUILD)/gpumem ] || [ -n "$$(find src include tools CMakeLists.txt -newer $(BUILD)/gpumem 2>/dev/null | head -n 1)" ]; then \
	  echo "building gpumem..."; \
	fi; \
	log=$$(mktemp) || exit 1; \
	if { cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) && \
	     cmake --build $(BUILD) -j $(JOBS) --target gpumem_cli; } >"$$log" 2>&1; then \
	  rm -f "$$log"; \
	else \
	  cat "$$log"; rm -f "$$log"; echo "make demo: the build failed (log above)" >&2; exit 1; \
	fi
	@$(BUILD)/gpumem replay --compare traces/*.trace.gz

bench: build
	@$(BUILD)/gpumem replay --compare --detail --passes 5 traces/*.trace.gz

build-all:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# Synthetic workloads (bench/bench_synth.c) beyond the bundled traces.
synth: build-all
	@mkdir -p $(BUILD)/synth && $(BUILD)/bench/bench_synth $(BUILD)/synth >/dev/null
	@$(BUILD)/gpumem replay --compare --detail --min-limit $(BUILD)/synth/*.trace

python-test: build
	bash tests/test_python.sh $(BUILD)

# On a machine with an NVIDIA GPU (see BENCHMARKS.md for the figures).
gpu-torch: build
	bash tests/gpu/torch/run.sh $(BUILD)

bench-torch: build
	bash bench/torch/run_all.sh $(BUILD)

# Step times of native PyTorch and gpumem trained in turns, step by step, on one GPU.
bench-torch-lockstep: build
	bash bench/torch/lockstep.sh $(BUILD)

# Step times of native PyTorch and gpumem started in pairs on two GPUs.
bench-torch-paired: build
	bash bench/torch/paired_ab.sh $(BUILD)

# What the allocator costs per request through torch's allocator interface:
# the bundled traces' requests from compiled C++, native and gpumem in turn.
bench-torch-requests: build
	bash bench/torch/requests.sh $(BUILD)

gpu-bench:
	bash bench/gpu/run_gpu_bench.sh

format:
	clang-format -i include/*.h src/*.c src/*.h tools/*.c tools/*.h tests/*.c tests/*.h tests/gpu/*.c tests/gpu/*.h bench/*.c bench/plan/*.c bench/gpu/*.c

format-check:
	clang-format --dry-run --Werror include/*.h src/*.c src/*.h tools/*.c tools/*.h tests/*.c tests/*.h tests/gpu/*.c tests/gpu/*.h bench/*.c bench/plan/*.c bench/gpu/*.c

clean:
	rm -rf $(BUILD) build-asan
