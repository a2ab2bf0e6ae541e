raise ImportError("NeMo RL's own logger was imported: ranklog.nemo.install() did not take")
