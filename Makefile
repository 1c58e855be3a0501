# The two commands of README.md:
#   make run    install dependencies, build, run the main job on its built-in default
#   make test   install dependencies, build, run the test suites (and the sanitizer build's cpu tests,
#               and a bounded fuzz run of every parser)
BUILD_DIR ?= build
SANITIZE_DIR ?= build-sanitize
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# The benchmark programs in bench/ run on a GPU host: scripts/gpu-run builds them there (or
# `make build BENCHMARKS=ON`); `make run` and `make test` leave them out, which keeps the CPU-only
# build short.
BENCHMARKS ?= OFF

.PHONY: run test setup build build-sanitize test-sanitize test-fuzz format clean

setup:
	scripts/setup

build: setup
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DMOELORA_BUILD_BENCHMARKS=$(BENCHMARKS) \
	  -DMOELORA_TEST_CXX_FLAGS="$(TEST_FLAGS)" $(CMAKE_FLAGS)
	cmake --build $(BUILD_DIR) -j $(JOBS)

run: build
	$(BUILD_DIR)/moelora run

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)
	$(MAKE) test-sanitize
	$(MAKE) test-fuzz

# The tests' own sources (fixtures, assertions) at -O1: a third less compile time than -O3 (8.2 ->
# 5.6 s for tests/unit/hf_quant_config_test.cpp); the libraries they test keep -O3.
TEST_FLAGS ?= -O1

# ASan + UBSan, CPU backend only, cpu-labelled tests. -O1 -g1 (line tables for the reports' stack
# traces) compiles in half the time of RelWithDebInfo's -O2 -g on this code (53 -> 24 s for
# tests/unit/ops_moe_test.cpp) and is the optimisation level the sanitizers' documentation suggests.
# The tests' and the tool's own sources at -O0 (16.4 -> 9.1 s for hf_quant_config_test.cpp under
# ASan; they were 60 % of this build's time); the libraries they drive keep -O1.
SANITIZE_FLAGS ?= -O1 -g1 -DNDEBUG
SANITIZE_DRIVER_FLAGS ?= -O0
build-sanitize: setup
	cmake -S . -B $(SANITIZE_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOELORA_ENABLE_CUDA=OFF \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$(SANITIZE_FLAGS)" \
	  -DMOELORA_ENABLE_SANITIZERS=ON -DMOELORA_BUILD_BENCHMARKS=OFF \
	  -DMOELORA_TEST_CXX_FLAGS="$(SANITIZE_DRIVER_FLAGS)" -DMOELORA_TOOL_CXX_FLAGS="$(SANITIZE_DRIVER_FLAGS)"
	cmake --build $(SANITIZE_DIR) -j $(JOBS)

test-sanitize: build-sanitize
	ctest --test-dir $(SANITIZE_DIR) --output-on-failure -j $(JOBS) -L cpu -LE slow

# Every libFuzzer target for FUZZ_SECONDS from its committed seeds, a fixed libFuzzer seed (the same
# mutations from run to run); any crash, sanitizer report, timeout or out-of-memory fails.
FUZZ_SECONDS ?= 45
test-fuzz: setup
	for t in $$(scripts/fuzz --list); do scripts/fuzz $$t $(FUZZ_SECONDS) -seed=1 || exit 1; done

format:
	find src tools tests bench -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR) $(SANITIZE_DIR) build-fuzz
