# pipegoose — build, test, benchmark, install.
#
#   make            optimised for this machine (-O3 -march=native, OpenMP)
#   make PORTABLE=1 a generic x86-64 build
#   make debug      -O0 -g into build-debug/
#   make asan       AddressSanitizer + UBSan build into build-asan/, then the suite under it
#   make test       the whole suite (busted specs + distributed runs); last line "N passed, N failed"
#   make run        install deps, build, prepare the default corpus, train the default model
#   make bench      training-step benchmarks (tokens/s, MFU against OpenBLAS sgemm)
#   make bench-comm collective bandwidth against raw MPI
#   make install PREFIX=/usr/local
#   make cuda-emu   the CUDA kernels' self-test on the CPU emulator (no GPU needed)
#   make emu        build-emu/pglua: the runtime on an emulated CUDA device (device = "cuda" without a GPU)
#   make mutate     one-line bugs (scripts/mutations.lua), each must make a spec fail; MUTATE_ARGS=--only=a,b
#   make fuzz       libFuzzer (clang) on the file readers, FUZZ_SECONDS each (fuzz/; the corpus replays in make test)
#   make CUDA=0     never build the CUDA kernels (default: auto-detect nvcc; CUDA=1 requires it)

VERSION  := 0.1.0
BUILD    ?= build
PREFIX   ?= /usr/local
PORTABLE ?= 0
DEBUG    ?= 0
SAN      ?= 0
CUDA     ?= auto

CC       := mpicc
MPICXX   := mpicxx
DEPS_OK  := $(BUILD)/.deps-ok

# src/ has one folder per layer of the house (docs/DESIGN.md, "Layers"); every
# folder is on the include path, so a header is named by its file alone, as it
# is once installed (pipegoose/pg_*.h).
RUNTIME_DIRS := src/runtime src/parallel src/nn src/engine src/backend src/tokenizer
SRC_INCLUDES := $(addprefix -I,$(RUNTIME_DIRS) src/lua)

# Recursive (=) so pkg-config runs after scripts/install-deps.sh has run.
# PCRE2 (the tokenizers' pre-tokenizer regexes, with JIT) and utf8proc (their NFC/NFKC normalizers).
PKG_CFLAGS = $(shell pkg-config --cflags lua5.4 openblas libpcre2-8 libutf8proc)
PKG_LIBS   = $(shell pkg-config --libs lua5.4 openblas libpcre2-8 libutf8proc)

ifeq ($(FUZZ),1)
  # make fuzz: clang through Open MPI's wrapper, coverage for libFuzzer, sanitizers on
  export OMPI_CC := clang
  OPTFLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined
  SANLD    := -fsanitize=address,undefined
else ifeq ($(SAN),1)
  OPTFLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
  SANLD    := -fsanitize=address,undefined
else ifeq ($(DEBUG),1)
  OPTFLAGS := -O0 -g
else ifeq ($(PORTABLE),1)
  OPTFLAGS := -O3 -mtune=generic
else
  OPTFLAGS := -O3 -march=native
endif

# CUDA: auto-detected from nvcc on the PATH or under CUDA_HOME (or /usr/local/cuda).
# CUDA=1 insists (an error without nvcc); CUDA=0 never compiles anything CUDA.
CUDA_HOME ?= /usr/local/cuda
NVCC_FOUND := $(or $(shell command -v nvcc 2>/dev/null),$(wildcard $(CUDA_HOME)/bin/nvcc))
ifeq ($(CUDA),0)
  NVCC :=
else
  NVCC := $(NVCC_FOUND)
  ifeq ($(CUDA)$(NVCC),1)
    $(error CUDA=1 but no nvcc on the PATH or at $(CUDA_HOME)/bin/nvcc; set CUDA_HOME, or build with CUDA=0)
  endif
endif
CUDA_SRCS := $(wildcard kernels/cuda/*.cu)
ifneq ($(and $(NVCC),$(CUDA_SRCS)),)
  CUDA_ROOT  := $(patsubst %/bin/nvcc,%,$(NVCC))
  CUDA_OBJS  := $(CUDA_SRCS:kernels/cuda/%.cu=$(BUILD)/cuda/%.o)
  # cuBLAS is not linked: src/backend/pg_cublas.c opens it on first use (its start-up
  # costs every process ~0.2 s); the soname's major version comes from the toolkit.
  CUBLAS_MAJOR := $(shell ls $(CUDA_ROOT)/lib64/libcublas.so.* 2>/dev/null | sed -n 's/.*libcublas\.so\.\([0-9]*\)$$/\1/p' | head -n 1)
  CUDA_DEFS  := -DPG_WITH_CUDA=1 -I$(CUDA_ROOT)/include -DPG_CUBLAS_SONAME_MAJOR='"$(or $(CUBLAS_MAJOR),13)"'
  CUDA_LIBS  := -L$(CUDA_ROOT)/lib64 -Wl,-rpath,$(CUDA_ROOT)/lib64 -lcudart -lnccl -lstdc++
  CUDA_OK    := $(BUILD)/.cuda-ok
  NVCCFLAGS  := -O3 -std=c++17 -DPG_WITH_CUDA=1 -Xcompiler -fPIC,-Wall,-Wextra -Ikernels $(SRC_INCLUDES) \
                --generate-code arch=compute_90,code=sm_90 --generate-code arch=compute_80,code=sm_80 \
                -Wno-deprecated-gpu-targets
endif
# Objects remember whether they were compiled with CUDA: switching CUDA= in
# one BUILD folder recompiles the C files whose code depends on it.
CUDA_STAMP := $(BUILD)/.cuda-config
ifeq ($(filter clean,$(MAKECMDGOALS)),)
  $(shell mkdir -p $(BUILD) && { echo '$(CUDA_DEFS) $(CUDA_LIBS)' | cmp -s - $(CUDA_STAMP) || echo '$(CUDA_DEFS) $(CUDA_LIBS)' > $(CUDA_STAMP); })
endif

CFLAGS   = -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -fPIC -fopenmp $(OPTFLAGS) $(SRC_INCLUDES) -Ikernels -DPG_VERSION='"$(VERSION)"' \
           $(CUDA_DEFS) $(PKG_CFLAGS)
# oneDNN (libdnnl-dev) has no pkg-config file in Debian: the bf16 GEMMs (src/backend/cpu_bf16_gemm.c).
DNNL_LIBS := -ldnnl
LDLIBS   = $(PKG_LIBS) $(CUDA_LIBS) $(DNNL_LIBS) -lz -lm -ldl
LDFLAGS  = -fopenmp $(SANLD)

RUNTIME_SRCS  := $(foreach d,$(RUNTIME_DIRS),$(wildcard $(d)/*.c)) $(wildcard kernels/cpu/*.c)
BINDING_SRCS  := $(filter-out src/lua/pglua.c,$(wildcard src/lua/*.c))
RUNTIME_OBJS  := $(RUNTIME_SRCS:%.c=$(BUILD)/obj/%.o) $(CUDA_OBJS)
BINDING_OBJS  := $(BINDING_SRCS:%.c=$(BUILD)/obj/%.o)
HEADERS       := $(wildcard src/*/*.h kernels/*.h kernels/cpu/*.h)

PGLUA      := $(BUILD)/pglua
CORE_SO    := $(BUILD)/lua/pipegoose/core.so
LIB_A      := $(BUILD)/libpipegoose.a
LIB_SO     := $(BUILD)/libpipegoose.so

.PHONY: all deps debug asan test test-unit mutate emu cuda-emu run bench bench-comm install uninstall clean fuzz \
        fuzz-replay fuzz-build

all: $(PGLUA) $(CORE_SO) $(LIB_A) $(LIB_SO)
ifeq ($(BUILD),build)
all: pglua
pglua: $(PGLUA)
	ln -sf $(PGLUA) pglua
endif

deps: $(DEPS_OK)
$(DEPS_OK): scripts/install-deps.sh
	@mkdir -p $(BUILD)
	scripts/install-deps.sh
	@touch $@

# Kernels: let GCC turn float selects into blends (vectorised exp, GELU, softmax)
# and sqrtf into vsqrtps (AdamW). Values are unchanged; only FP exception flags
# and errno may differ.
$(BUILD)/obj/kernels/cpu/%.o: CFLAGS += -fno-trapping-math -fno-math-errno

$(BUILD)/obj/%.o: %.c $(HEADERS) $(CUDA_STAMP) | $(DEPS_OK) $(CUDA_OK)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/cuda/%.o: kernels/cuda/%.cu kernels/cuda/common.cuh $(HEADERS) | $(DEPS_OK) $(CUDA_OK)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

# nvcc alone is not enough: the CUDA runtime, cuBLAS and NCCL headers and
# libraries must be there too. Checked once, before anything compiles, with a
# message that says what to do (rather than a link error at the end).
ifneq ($(CUDA_OK),)
$(CUDA_OK): $(CUDA_STAMP) | $(DEPS_OK)
	@printf '#include <cuda_runtime.h>\n#include <cublas_v2.h>\n#include <nccl.h>\nint main(void) { int v; cudaRuntimeGetVersion(&v); cublasGetProperty(MAJOR_VERSION, &v); ncclGetVersion(&v); return 0; }\n' > $(BUILD)/cuda-check.c
	@$(CC) $(CUDA_DEFS) $(BUILD)/cuda-check.c -o $(BUILD)/cuda-check $(CUDA_LIBS) -lcublas > $(BUILD)/cuda-check.log 2>&1 || { \
	  cat $(BUILD)/cuda-check.log; \
	  echo "error: nvcc was found ($(NVCC)) but a program using the CUDA runtime, cuBLAS and NCCL does not build"; \
	  echo "       with $(CUDA_DEFS) $(CUDA_LIBS) (log above)."; \
	  echo "       Install the missing headers/libraries, point CUDA_HOME at a complete toolkit, or build with make CUDA=0."; \
	  exit 1; }
	@touch $@
endif

$(LIB_A): $(RUNTIME_OBJS)
	ar rcs $@ $^

$(LIB_SO): $(RUNTIME_OBJS)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(filter-out -llua5.4,$(LDLIBS))

$(PGLUA): $(BUILD)/obj/src/lua/pglua.o $(BINDING_OBJS) $(RUNTIME_OBJS)
	$(CC) $(LDFLAGS) -rdynamic -o $@ $^ $(LDLIBS)

# The Lua C module for a plain lua5.4: no liblua (the interpreter provides it).
$(CORE_SO): $(BINDING_OBJS) $(RUNTIME_OBJS)
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(filter-out -llua5.4,$(LDLIBS))

debug:
	$(MAKE) BUILD=build-debug DEBUG=1 all

# Fuzz targets (fuzz/targets.c: safetensors, manifest, shard, llmc). The
# replay binaries run each target once on every file of its seed corpus
# (fuzz/corpus/<target>/) and are built with the suite (spec/unit/fuzz_spec.lua
# runs them); `make fuzz` builds the libFuzzer binaries with clang into
# build-fuzz/ and fuzzes each target FUZZ_SECONDS (default 60), new inputs
# going to build-fuzz/corpus/<target>/ (copy the interesting ones into fuzz/corpus).
FUZZ_TARGETS := safetensors manifest shard llmc tokenizer tokenizer_encode
FUZZ_SECONDS ?= 60
FUZZ_REPLAY  := $(FUZZ_TARGETS:%=$(BUILD)/fuzz/replay_%)
FUZZ_CFLAGS   = $(CFLAGS) -Ifuzz -DPG_FUZZ_ROOT='"$(CURDIR)"'

fuzz-replay: $(FUZZ_REPLAY)

$(BUILD)/fuzz/replay_%: fuzz/targets.c fuzz/main_replay.c fuzz/fuzz.h $(BINDING_OBJS) $(RUNTIME_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(FUZZ_CFLAGS) -DPG_FUZZ_TARGET=fuzz_$* $(LDFLAGS) -o $@ fuzz/targets.c fuzz/main_replay.c \
	  $(BINDING_OBJS) $(RUNTIME_OBJS) $(LDLIBS)

$(BUILD)/fuzz/fuzz_%: fuzz/targets.c fuzz/main_libfuzzer.c fuzz/fuzz.h $(BINDING_OBJS) $(RUNTIME_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -DPG_FUZZ_TARGET=fuzz_$* $(LDFLAGS) -o $@ fuzz/targets.c \
	  fuzz/main_libfuzzer.c $(BINDING_OBJS) $(RUNTIME_OBJS) $(LDLIBS)

fuzz-build: $(FUZZ_TARGETS:%=$(BUILD)/fuzz/fuzz_%)

fuzz: | $(DEPS_OK)
	@command -v clang > /dev/null || { echo "make fuzz needs clang (apt-get install clang)"; exit 1; }
	$(MAKE) BUILD=build-fuzz FUZZ=1 CUDA=0 fuzz-build
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build-fuzz/corpus/$$t; \
	  echo "== fuzz $$t ($(FUZZ_SECONDS) s)"; \
	  $(ASAN_ENV) build-fuzz/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 -malloc_limit_mb=1024 \
	    -timeout=10 build-fuzz/corpus/$$t fuzz/corpus/$$t || exit 1; \
	done

ASAN_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=1:fast_unwind_on_malloc=0:malloc_context_size=30 \
            LSAN_OPTIONS=suppressions=$(CURDIR)/spec/support/lsan.supp:print_suppressions=0 \
            UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
asan:
	$(MAKE) BUILD=build-asan SAN=1 all fuzz-replay
	$(MAKE) emu
	$(ASAN_ENV) PG_SANITIZE=1 PGLUA=build-asan/pglua scripts/run_tests.sh

test: all emu fuzz-replay
	PGLUA=$(PGLUA) PG_CUDA=$(CUDA) PG_EMU_PGLUA=$(EMU_BUILD)/pglua scripts/run_tests.sh

# Only the plain busted specs (fast, no mpirun).
test-unit: all emu
	PGLUA=$(PGLUA) PG_CUDA=$(CUDA) PG_EMU_PGLUA=$(EMU_BUILD)/pglua PG_TEST_ONLY=unit scripts/run_tests.sh

# The emulated device: build-emu/pglua is the whole runtime with CUDA on,
# where the CUDA runtime, cuBLAS and NCCL are the CPU stand-ins of
# spec/support/cuda_emu (device memory is host memory, block threads are
# fibers). kernels/cuda/*.cu are compiled as C++ with each kernel<<<...>>>(
# launch rewritten as a call. For CI without a GPU: device = "cuda" runs the
# real CUDA kernels' logic here, slowly. PG_EMU_STATS=1 prints what ran.
EMU_BUILD   := build-emu
EMU_DIR     := spec/support/cuda_emu
EMU_FLAGS   ?=
EMU_CFLAGS   = -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -fPIC -fopenmp -O2 -g -ffp-contract=off \
               $(SRC_INCLUDES) -Ikernels -I$(EMU_DIR) -DPG_WITH_CUDA=1 -DPG_VERSION='"$(VERSION)"' $(PKG_CFLAGS) $(EMU_FLAGS)
EMU_CXXFLAGS = -std=c++17 -Wall -Wextra -Wno-unused-parameter -fPIC -O2 -g -ffp-contract=off -DPG_EMU_MPI=1 \
               $(SRC_INCLUDES) -Ikernels -Ikernels/cuda -I$(EMU_DIR) -DPG_WITH_CUDA=1 $(EMU_FLAGS)
EMU_C_SRCS  := $(filter-out src/backend/pg_cublas.c,$(wildcard src/*/*.c)) $(wildcard kernels/cpu/*.c)
EMU_OBJS    := $(EMU_C_SRCS:%.c=$(EMU_BUILD)/obj/%.o) $(CUDA_SRCS:kernels/cuda/%.cu=$(EMU_BUILD)/cuda/%.o) \
               $(EMU_BUILD)/emu.o
EMU_HEADERS := $(HEADERS) $(wildcard $(EMU_DIR)/*.h) kernels/cuda/common.cuh

emu: $(EMU_BUILD)/pglua

$(EMU_BUILD)/pglua: $(EMU_OBJS)
	$(CC) -fopenmp $(EMU_FLAGS) -rdynamic -o $@ $^ $(PKG_LIBS) $(DNNL_LIBS) -lstdc++ -lz -lm -ldl

$(EMU_BUILD)/obj/%.o: %.c $(EMU_HEADERS) | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -c $< -o $@

# kept: the rewritten sources are what a debugger and the emulator's messages point at
.PRECIOUS: $(EMU_BUILD)/cuda/%.cpp
$(EMU_BUILD)/cuda/%.cpp: kernels/cuda/%.cu
	@mkdir -p $(dir $@)
	sed -E 's/([A-Za-z_][A-Za-z0-9_]*)<<<(.*)>>>\(/pg_emu_launch(\1, \2)(/' $< > $@
	@! grep -n '<<<' $@ || { echo "$<: a launch the emulator's rewrite does not understand (one line: kernel<<<...>>>()"; rm -f $@; exit 1; }

$(EMU_BUILD)/cuda/%.o: $(EMU_BUILD)/cuda/%.cpp $(EMU_HEADERS) | $(DEPS_OK)
	$(MPICXX) $(EMU_CXXFLAGS) -c $< -o $@

$(EMU_BUILD)/emu.o: $(EMU_DIR)/emu.cpp $(EMU_HEADERS) | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(MPICXX) $(EMU_CXXFLAGS) -c $< -o $@

# Mutation check (not in CI: minutes per mutation): prints caught / not caught
# per mutation of scripts/mutations.lua; exit 1 unless all are caught.
MUTATE_ARGS ?=
mutate: all
	$(PGLUA) scripts/mutate.lua $(MUTATE_ARGS)

# The CUDA kernels against the CPU kernels, on the CPU (spec/support/cuda_emu).
cuda-emu: | $(DEPS_OK)
	scripts/cuda_emu_test.sh $(BUILD)/cuda-emu

# The byte-level fortunes (scripts/prepare_corpus.lua without --tokenizer): the
# examples' data without --corpus, and some specs'.
data/fortunes_train.bin data/fortunes_val.bin: | $(PGLUA)
	$(PGLUA) scripts/prepare_corpus.lua --out=data

# make run's corpus, from Debian packages (scripts/install-deps.sh): the fortunes
# (one fortune = one document; the plain files, not the .dat indexes or the .u8
# links) and the King James Bible of bible-kjv (one chapter = one document, a
# verse a line: `bible -l0` prints the whole book unwrapped, and awk drops the
# verse numbers and turns each chapter heading into the fortunes' separator
# line "%"). 5% of the documents are validation; a byte-level BPE of RUN_VOCAB
# ids is trained on them (1.4 s with the rest; 3.4 bytes a token).
RUN_VOCAB  ?= 4096
RUN_CORPUS := data/corpus
FORTUNES   := /usr/share/games/fortunes
data/kjv.txt: | $(DEPS_OK)
	@mkdir -p data
	bible -l0 Gen1:1-Rev22:21 > $@.bible
	awk '/^  *[0-9]+ / { sub(/^  *[0-9]+ /, ""); print; next } /./ { print "%" }' $@.bible > $@.tmp
	@test -s $@.tmp || { echo "error: bible -l0 Gen1:1-Rev22:21 printed no verses (is bible-kjv-text installed?)"; exit 1; }
	rm -f $@.bible
	mv $@.tmp $@
$(RUN_CORPUS)/dataset.json: data/kjv.txt | $(PGLUA)
	$(PGLUA) scripts/prepare_corpus.lua --tokenizer=train:$(RUN_VOCAB) --separator=% --val-fraction=0.05 \
	  --input=$$(find $(FORTUNES) -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort | paste -sd, -) \
	  --input=data/kjv.txt --out=$(RUN_CORPUS) --overwrite

# make run: a small LLaMA trained on that corpus (examples/train_llama.lua's
# defaults: about 2.5 minutes on 2 quiet cores, README's quick start), its sample, bits per byte and the share
# of the sample's words in the dictionary, then a transformers directory.
RUN_ARGS ?=
RUN_EXPORT ?= runs/llama_hf
run: all $(RUN_CORPUS)/dataset.json
	$(PGLUA) examples/train_llama.lua --corpus=$(RUN_CORPUS) --save-hf=$(RUN_EXPORT) $(RUN_ARGS)

# Training-step benchmarks with ratios against peers measured in the same run
# (sgemm peak, PyTorch CPU, llm.c with LLMC_DIR=checkout, one rank);
# BENCH_ONLY=peak,gpt2,... runs some parts (`./pglua scripts/bench.lua --help`
# lists them and what each does).
bench: all
	$(PGLUA) scripts/bench.lua

bench-comm: all
	scripts/mpirun.sh -np 2 $(PGLUA) scripts/bench_comm.lua

install: all
	install -d $(PREFIX)/bin $(PREFIX)/lib $(PREFIX)/lib/pkgconfig $(PREFIX)/include/pipegoose \
	  $(PREFIX)/share/lua/5.4/pipegoose $(PREFIX)/lib/lua/5.4/pipegoose
	install -m 755 $(PGLUA) $(PREFIX)/bin/pglua
	install -m 644 $(LIB_A) $(PREFIX)/lib/
	install -m 755 $(LIB_SO) $(PREFIX)/lib/
	install -m 755 $(CORE_SO) $(PREFIX)/lib/lua/5.4/pipegoose/core.so
	install -m 644 $(wildcard $(RUNTIME_DIRS:%=%/pg_*.h)) kernels/kernels.h kernels/kernel_list.h $(PREFIX)/include/pipegoose/
	cp -R lua/pipegoose/. $(PREFIX)/share/lua/5.4/pipegoose/
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' -e 's|@CUDA_LIBS@|$(CUDA_LIBS) $(DNNL_LIBS)|g' scripts/pipegoose.pc.in > $(PREFIX)/lib/pkgconfig/pipegoose.pc

uninstall:
	rm -rf $(PREFIX)/bin/pglua $(PREFIX)/lib/libpipegoose.* $(PREFIX)/include/pipegoose \
	  $(PREFIX)/share/lua/5.4/pipegoose $(PREFIX)/lib/lua/5.4/pipegoose $(PREFIX)/lib/pkgconfig/pipegoose.pc

clean:
	rm -rf build build-debug build-asan build-emu build-fuzz pglua
