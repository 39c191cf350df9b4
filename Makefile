# kvslim top-level driver. `make run` and `make test` work on a fresh Debian 12 machine:
# each installs the missing apt packages (when root), configures, builds Release and runs.

BUILD    ?= build
JOBS     ?= $(shell nproc)
CMAKE_FLAGS ?=
# The Python package (python/): Debian's interpreter, whatever python3 is first on PATH.
PYTHON   ?= /usr/bin/python3
PYTHON_FLAGS ?= -DKVSLIM_BUILD_PYTHON=ON -DPython3_EXECUTABLE=$(PYTHON)
APT_PACKAGES := build-essential cmake pkg-config libgtest-dev libgmock-dev libbenchmark-dev \
  libopenblas-dev libhwy-dev nlohmann-json3-dev libcli11-dev libpcre2-dev libutf8proc-dev \
  gnuplot-nox clang libclang-rt-14-dev \
  pybind11-dev python3-dev python3-numpy python3-pytest python3-torch

.PHONY: deps configure build run test bench clean python-install

deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "missing packages (run as root or install them):$$missing"; exit 1; fi; \
	fi

configure: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(PYTHON_FLAGS) $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# The main job on the shipped default (see README "Quick start").
run: build
	./$(BUILD)/bin/kvslim eval --model models/tiny

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

bench: build
	./$(BUILD)/bin/kvslim bench squeeze

# The kvslim Python package into $(PYTHON)'s site-packages (README "Python").
python-install: configure
	@cmake --build $(BUILD) -j $(JOBS) --target kvslim_python
	@cmake --install $(BUILD) --component python
	@cd / && $(PYTHON) -c "import kvslim; print('kvslim installed:', kvslim.__file__)"

clean:
	rm -rf $(BUILD)
