"""Settings of the multi-file project (tpu_utility's port corpus)."""
SEED = 0
VOCAB = 40
PAD = 0
SEQ_LEN = 16
N_CLASSES = 4
D_MODEL = 32
N_HEADS = 4
N_LAYERS = 2
FF_DIM = 64
N_TRAIN = 256
N_VALID = 128
BATCH_SIZE = 32
EPOCHS = 4
LR = 3e-3
WARMUP_STEPS = 4
LOG_EVERY = 4
CHECKPOINT = "classifier.pt"
