#pragma once
// Layer-input extraction is exported by libllama (C++ linkage) but declared
// only in llama.cpp's staging header src/llama-ext.h, which the wheel does not
// install. These are exactly its prototypes; nothing else is declared here.
#include <cstdint>

#include "llama.h"

void llama_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bool value);
float * llama_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid);
