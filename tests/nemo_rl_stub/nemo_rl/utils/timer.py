raise ImportError("NeMo RL's own timer was imported: ranklog.nemo.install() did not take")
