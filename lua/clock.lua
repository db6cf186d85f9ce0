-- The store's clock: a gateway or limiterd whose clock runs fast cannot mint
-- tokens. Microseconds since the Unix epoch, exact in a Lua double.
-- Added to every relative expiry: none in production (see clock_fixed.lua).
local EXPIRY_PAD_MS = 0

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
